"""fleetfit's Flower ClientApp: node facts -> train on local data -> reply.

Importing the package turns MKL's pool of matrix-multiply work buffers off for this
process (``MKL_DISABLE_FAST_MM=1``, unless the environment sets it), as in every
measuring child (``memory.measure.CHILD_ENV``): a node that trains inline then
matches the memory model too. MKL reads the variable when torch loads, so it takes
effect only where this package is imported before torch, as a SuperNode loading the
ClientApp does; otherwise set it in the node's environment.
"""

import os

os.environ.setdefault("MKL_DISABLE_FAST_MM", "1")
