"""The multi-process runtime: the placement strategy for nodes placed on workers (control socket, links, launchers)."""
