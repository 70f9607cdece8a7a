"""How good a draft and a run are: the acceptance bench through SGLang's EAGLE-3 speculation,
simulated acceptance on captured features, and the report of an online run."""
