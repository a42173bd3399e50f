"""The user's state as lazyckpt sees it: providers (a state <-> a JSON tree + byte
sources), the plan cache of the previous walk, and the one walker of a footer's tree."""
