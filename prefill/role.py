"""The prefill role: engines that compute prompts and hand their KV over (KV producers), placed
on nodes offering the Ray resource `prefill`; no client streams from them."""

from engine.role_spec import PD_ENV, PD_VLLM_ARGS, Role, RoleSpec

PREFILL = RoleSpec(
    Role.PREFILL, ray_resource="prefill", vllm_args=PD_VLLM_ARGS, env=PD_ENV, kv_transfer=True,
    direct_kv_role="kv_producer",
    serves_clients=False, takes_remote_prefills=True, waits_on_queue=False, prefills=True,
)
