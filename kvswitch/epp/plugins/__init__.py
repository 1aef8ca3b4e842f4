"""Built-in scheduling plugins, one per module, each exporting `TYPE` and `create()`."""
