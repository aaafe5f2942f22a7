"""The prefill pool: engine instances in the KV-producer role, placed on nodes that offer the
Ray resource `prefill`. (The P/D topology is built in its own issue; today every instance is
colocated.)"""
