"""Pure domain helpers every layer may use (they import only the ground files): kernel
classes, rank and node mapping, hashing."""
