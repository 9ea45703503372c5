"""Every private-torch import of hyper_parallel lives in this package, one module per torch
subsystem.

A torch upgrade that moves or renames one of these names is fixed here only; the rest of the
package imports them from ``hyper_parallel.compat`` (tests/package/test_imports.py enforces it).
Anything imported here is an implementation detail of torch that the compiler relies on: the
joint-graph export with descriptors (``export``), fake tensors and symbolic shapes
(``fake_tensor``), DTensor's sharding-strategy registry (our rule database), specs and local
redistribution (``dtensor``), device meshes and process groups (``distributed``), the op
dispatcher and pytree (``dispatch``), fx graph internals (``fx``), autograd's checkpointing and
graph task (``autograd``), the profiler (``profiler``), Dynamo while it calls our backend
(``dynamo``) and Inductor's compiler (``inductor``). Each module holds only the access to torch's
private names; what the compiler decides with them lives in the module that owns the job.
"""

from .dispatch import *  # noqa: F401,F403
from .export import *  # noqa: F401,F403
from .fake_tensor import *  # noqa: F401,F403
from .autograd import *  # noqa: F401,F403
from .dtensor import *  # noqa: F401,F403
from .distributed import *  # noqa: F401,F403
from .profiler import *  # noqa: F401,F403
from .fx import *  # noqa: F401,F403
from .dynamo import *  # noqa: F401,F403
from .inductor import *  # noqa: F401,F403
from . import dispatch, export, fake_tensor, autograd, dtensor, distributed, profiler, fx, dynamo, inductor

# Each submodule's __all__ is what it exports; the package re-exports them all.
__all__ = [name for module in (dispatch, export, fake_tensor, autograd, dtensor, distributed, profiler, fx, dynamo,
                               inductor) for name in module.__all__]
