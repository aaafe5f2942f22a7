"""Starting pdcluster: the `pdcluster` command line, the Ray connection, the launcher that
starts engines and router, and (later) the `ray up` cluster YAMLs."""
