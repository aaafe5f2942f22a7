"""How the cluster's processes move bytes, below every other package: one-sided NIXL transfers
over UCX (`nixl`: RDMA on clusters, TCP or shared memory here), used by the weight plane and the
KV store alike, and ZMQ sockets that talk only to holders of the cluster's CURVE keys
(`zmq_curve`: the store's control sockets, the KV events); the address a process serves those
on (`address`); and listeners a stranger cannot exhaust: uvicorn's HTTP protocol under a book of
connections with deadlines (`listener_guard`: the router's, every engine's), the router's server
that keeps a connection bare until its request head is in (`guarded_server`), and the warden of
listeners whose accept loops belong to a library (`listener_warden`: UCX's, ZMQ's)."""
