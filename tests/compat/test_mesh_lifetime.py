"""A mesh a compile lowered through is freed once its owner drops it and the sharding caches are
cleared (``compat.clear_sharding_caches``, run when a mesh is created and after every test-pool
job). torch's DTensor keeps a redistribution planner per mesh that holds the mesh itself, under a
key that only references it weakly; a live mesh keeps its process groups, and a destroyed gloo group
that stays alive keeps its transport thread polling: the test workers once held over a hundred such
threads, which made the suite take 50 minutes instead of 30."""

import gc
import weakref

import pytest
import torch

import hyper_parallel as hp
from hyper_parallel import compat
from hyper_parallel.tools.explain import compile_for_explain, fake_world
from hyper_parallel.models.plans import llama_tp_plan
from hyper_parallel.testing.parity import build_model


@pytest.mark.slow
def test_a_compiled_mesh_is_freed_with_the_sharding_caches():
    with fake_world(4, 0):
        mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        with hp.init_empty_weights():
            model = build_model("llama")
        ids = torch.empty(4, 16, dtype=torch.long, device="meta")
        pmodel = compile_for_explain(model, llama_tp_plan(), mesh, (), {"input_ids": ids, "labels": ids})
        assert pmodel.compile_summary()["collectives_per_step"], "the compile redistributed over the mesh"
        freed = weakref.ref(mesh)
        del pmodel, mesh, model
        compat.clear_sharding_caches()
        gc.collect()
        alive = freed()
        assert alive is None, f"still referenced by {[type(r).__name__ for r in gc.get_referrers(alive)]}"
