"""The machinery every tile shares, and that the tuner and the command line know tiles through.

* :mod:`.arch` (GPU architectures and their TileLang targets), :mod:`.shapes` (the shape registry tied to the
  ``v4.1-flash`` preset), :mod:`.contract` (the ``Tile`` contract: shapes, search space, defaults, inputs, reference,
  FLOP/byte counts, comparison rule), :mod:`.registry` (finds every tile).
* :mod:`.harness` (compile, check and time one config), :mod:`.compare` (comparison rules), :mod:`.timing` (CUDA
  events, graph replay, the device's copy bandwidth, the environment block), :mod:`.ptxas` (register/spill reports).
* :mod:`.config_store` (tuned winners per arch and shape: loading, lookup, staleness), :mod:`.calls` (the config a
  public call runs with).
"""
