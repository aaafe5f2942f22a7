"""The P/D cluster this package's tests share."""

from __future__ import annotations

import os
from unittest import mock

import pytest


@pytest.fixture(scope="package")
def otlp_receiver():
    """The OTLP/gRPC receiver the served cluster's router and engines export their spans to."""
    from loadtest.otlp_receiver import OTLPReceiver

    with OTLPReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="package")
def served_pd(tiny_model, artifacts, otlp_receiver):
    """One prefill and one decode instance (tiny model) behind the router, KV handed over through
    the store shard; every request is prefilled remotely (threshold 0). The shard honours fault
    injection (tests damage stored chunks); the router and engines export traces to
    `otlp_receiver`. Package-scoped: it stops once this package's tests are done, so at most
    three engines run at once."""
    from deploy.serve import STORE_FAULT_INJECTION_ENV
    from loadtest.local_cluster import LocalServer

    args = ["--model", "tiny", "--prefill", "1", "--decode", "1", "--remote-prefill-min-tokens", "0",
            "--otlp-traces-endpoint", otlp_receiver.endpoint]
    with mock.patch.dict(os.environ, {STORE_FAULT_INJECTION_ENV: "1"}):
        server = LocalServer(args, artifacts / "serve-pd.log").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="package", autouse=True)
def first_engine_tokens(served_pd) -> list[str]:
    """The engine tokens of the cluster as it started (a later test kills its prefill engine, whose
    replacement has a token of its own): what no exported span may carry, with the current ones."""
    return [served_pd.engine_access(i["instance_id"]).token for i in served_pd.instances()]

