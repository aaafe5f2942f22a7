"""A decode pool scales from zero nodes and back, with Ray's fake multi-node autoscaler; the KV
store keeps a shard on every node as they come and go, and a store client follows."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).with_name("scale_decode_from_zero.py")


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs unshare as root")
def test_decode_pool_scales_from_zero_nodes_and_back():
    # Its own PID namespace: the `ray stop` that ends a fake cluster must not end the suite's others.
    command = ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, str(SCRIPT)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=420,
                            cwd=SCRIPT.parents[2], env={**os.environ, "PYTHONPATH": str(SCRIPT.parents[2])})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["decode_nodes_at_start"] == 0
    assert seen["decode_nodes_in_use"] == 2 and seen["distinct_nodes"] == 2
    assert seen["decode_nodes_at_end"] == 0
    assert seen["store_shards_at_start"] == 1  # the head's
    assert seen["store_shards_after_scale_up"] == 3 and seen["client_shards_after_scale_up"] == 3
    assert seen["store_shards_after_engines_left"] == 1
