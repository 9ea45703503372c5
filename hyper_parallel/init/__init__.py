"""Building models without memory and materialising only this rank's shards.

A user builds the model under :func:`init_empty_weights` (every parameter and buffer on the meta
device, no memory, no random numbers drawn) and ``parallelize`` calls :func:`distribute_parameters`,
which gives every rank DTensor parameters holding only its own shards, with exactly the values a
single-device model built with the same seed would hold::

    hp.manual_seed(0)                       # same seed on every rank
    with hp.init_empty_weights():
        model = LlamaForCausalLM(cfg)       # meta: no memory
    pmodel = hp.parallelize(model, plan, mesh)
    # parameters == shards of (torch.manual_seed(0); LlamaForCausalLM(cfg)), bit for bit

How the values are reproduced (the *replay*): a model's constructor initialises its parameters by
drawing from the global CPU generator in a fixed order, so every rank re-runs those draws in the same
order, one module at a time, and keeps only its slice of each result. The replay is a schedule of
steps (:func:`.schedule._schedule`):

1. *reset* steps. Modules are visited in registration order (``named_modules()``), which is the
   order their constructors ran. Each module with parameters or buffers of its own gets them
   materialised on CPU (``to_empty``, one module at a time) and runs its own ``reset_parameters()``
   — the ``nn.Module`` convention that ``nn.Linear``, ``nn.Embedding``, the norms ... follow in
   ``__init__``. This also recomputes non-persistent buffers that ``__init__`` computed (e.g. the
   rotary ``inv_freq``, see :class:`~hyper_parallel.models.llama.LlamaRotaryEmbedding`). A tensor
   tied to one initialised earlier (``lm_head.weight = embed_tokens.weight``) gets a scratch tensor:
   the constructor built and initialised the module's own weight before tying, so its draws must be
   consumed and the values dropped.
2. *hook* steps, for the model init hook a constructor runs after building its modules. Known
   hooks: a root ``init_weights()`` (:class:`~hyper_parallel.models.LlamaForCausalLM`, torchtitan
   style; assumed to run at the end of construction), which visits ``modules()`` and
   re-initialises the tensors not on the meta device; and transformers' ``post_init``, which each
   ``PreTrainedModel`` (nested ones included) runs at the end of its own constructor, applying its
   ``_init_weights`` children-first to the modules no nested model initialised, before tying. The
   hook is called once per module with only that module's tensors materialised (everything else
   on meta, where init ops are no-ops and draw nothing), so the draws happen in single-device
   order. A tensor the hook leaves unwritten keeps its construction value: it is rebuilt from the
   generator state saved before the module's reset step and the hook re-run on top.

A tensor's value is final after its last step. It is then split with
``distribute_tensor(t, mesh, placements, src_data_rank=None)`` (local slicing, no communication),
the shard gets its own compact storage, and the full tensor is dropped.

Memory: full tensors live in one reusable CPU buffer sized for the module owning the most bytes
directly (for the models here: one parameter, the embedding), so a rank holds its own shards plus
that buffer: ``peak <= final local bytes + largest module's bytes``, counted in :class:`InitStats`
and matching the process's RSS growth (a buffer reused, rather than a malloc/free per tensor,
avoids heap fragmentation that would otherwise keep freed memory resident). On an accelerator mesh,
one full tensor is also copied to the device transiently (as ``distribute_tensor`` does). The model
is never whole on any rank.

Assumptions, documented rather than guessed: a module's ``reset_parameters()`` initialises its own
(direct) parameters and buffers, and a constructor creates and initialises a module's own tensors
in registration order; an init hook that writes a tensor writes all of it; values come from the
CPU generator (what a model built on CPU holds). The replay draws from the global CPU generator as
it is when :func:`distribute_parameters` runs (building on meta draws nothing, so
``manual_seed(s)`` before ``init_empty_weights()`` works) and leaves it where single-device
construction would have. Ranks must have equal generator states: this is checked (a tiny object
all-gather over each mesh axis) and a mismatch is a ``ValueError``. Real (non-meta) tensors keep
their values (their draws are still replayed on scratch tensors so later meta tensors match).

The package, module by module:

* :mod:`.context`: :func:`init_on_device`, :func:`init_empty_weights`, :func:`manual_seed`.
* :mod:`.distribute`: :func:`distribute_parameters` (checks, then the replay or a plain split).
* :mod:`.tensors`: the model's distinct tensors and their tied aliases, placements, :class:`InitStats`.
* :mod:`.schedule`: the replay's steps (reset and hook steps) and the check that every meta module
  can be initialised.
* :mod:`.replay`: ``_Replay``, which runs the steps one module at a time.
* :mod:`.arena`: the reusable CPU buffer the full tensors of one module live in.
* :mod:`.sharding`: splitting a full tensor into this rank's shard and installing the results.
"""

from __future__ import annotations

from .context import init_empty_weights, init_on_device, manual_seed
from .distribute import distribute_parameters
from .tensors import InitStats

__all__ = [
    "InitStats",
    "distribute_parameters",
    "init_empty_weights",
    "init_on_device",
    "manual_seed",
]
