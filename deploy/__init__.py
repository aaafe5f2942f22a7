"""Starting and sizing pdcluster: the `pdcluster` command line, the Ray connection, the launcher
that starts engines and router (a new node's start caches brought first from a ready peer), the
pool controller that grows and shrinks each role's pool, and the `ray up` cluster YAMLs."""
