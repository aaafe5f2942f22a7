"""How the cluster's processes move bytes, below every other package: one-sided NIXL transfers
over UCX (`nixl`: RDMA on clusters, TCP or shared memory here), used by the weight plane and the
KV store alike, and ZMQ sockets that talk only to holders of the cluster's CURVE keys
(`zmq_curve`: the store's control sockets, the KV events); and the address a process serves
those on (`address`)."""
