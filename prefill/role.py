"""The prefill role: engines that compute prompts and hand their KV over (KV producers), placed
on nodes offering the Ray resource `prefill`; no client streams from them."""

from engine.role_spec import Role, RoleSpec

PREFILL = RoleSpec(
    Role.PREFILL, ray_resource="prefill", kv_transfer=True,
    direct_kv_role="kv_producer",
    serves_clients=False, takes_remote_prefills=True, waits_on_queue=False, prefills=True,
)
