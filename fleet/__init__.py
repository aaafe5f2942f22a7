"""The live fleet as the routers see it: each engine instance's record (where its engine serves,
its role and model, its state, load, health and prefill circuit) and the registry, the one place
that changes them (`instances`). Below the request path (router/, prefill/, decode/) and the
fleet's owner (deploy/), which all read and report through it."""
