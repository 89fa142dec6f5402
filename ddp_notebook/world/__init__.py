"""The notebook kernel's side of a world: the `DDPCluster` facade, its config and lifecycle,
launchers and provisioners, which engine is which rank, forming and re-forming the group,
supervising it while a cell runs, the rank template, the export to a script. No torch: the
kernel only launches ranks. Imports `cell/` and `live/`, which never import it."""
