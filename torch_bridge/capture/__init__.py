"""Training state in and out of plain data and arrays, in one process: tensors and
DTensors as arrays, state dicts and optimizers as entries (:mod:`.layout`), RNG
states, the data position (:mod:`.sampler`), host staging buffers for async saves."""
