"""The decode pool: engine instances in the KV-consumer role, placed on nodes that offer the Ray
resource `decode`; they stream tokens. (The P/D topology is built in its own issue; today every
instance is colocated.)"""
