"""Hardware: spec catalogs and the cost functions the simulator charges."""
