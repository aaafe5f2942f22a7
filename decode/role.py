"""The decode role: engines that load a prompt's KV and stream the answer (KV consumers), placed
on nodes offering the Ray resource `decode`. They prefill themselves when the router decides so
(a short prompt, a busy or failed prefill pool), but a TTFT target is the prefill pool's."""

from engine.role_spec import Role, RoleSpec

DECODE = RoleSpec(
    Role.DECODE, ray_resource="decode", kv_transfer=True,
    direct_kv_role="kv_consumer",
    serves_clients=True, takes_remote_prefills=False, waits_on_queue=True, prefills=False,
)
