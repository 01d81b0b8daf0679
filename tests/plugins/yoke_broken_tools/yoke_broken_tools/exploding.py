"""A plugin module that fails at import: the mesh must list it unavailable and go on."""

raise RuntimeError("this plugin is broken on purpose")
