"""Starting and sizing pdcluster: the `pdcluster` command line, the Ray connection, the launcher
that starts engines and router, the pool controller that grows and shrinks each role's pool,
and the `ray up` cluster YAMLs."""
