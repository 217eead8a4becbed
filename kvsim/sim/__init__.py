"""The simpy discrete-event model of a serving engine (see :mod:`kvsim.sim.engine`)."""
