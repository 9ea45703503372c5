"""What a user reads when torch.export cannot capture a model whose code depends on tensor values
(compile/capture_errors.py): a ValueError naming the module and the line, not export's partial
graph; for transformers' expert loop (experts_implementation="eager") the implementations that
capture."""

import pytest
import torch
from torch import nn

from hyper_parallel.compile.capture import capture


class _Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:  # a branch on a tensor value
            return self.proj(x)
        return x


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = _Gate()

    def forward(self, x):
        return self.gate(x).sum()


def test_a_branch_on_a_tensor_value_names_module_and_line():
    with pytest.raises(ValueError) as info:
        capture(_Model(), (torch.randn(2, 8),), {})
    message = str(info.value)
    assert message.startswith("torch.export could not capture _Model: module 'gate' (_Gate) has code whose")
    assert "test_capture_errors.py" in message and "if x.sum() > 0:" in message
    assert "def forward" not in message  # export's partial graph is not repeated


def test_transformers_expert_loop_names_the_experts_and_the_fix():
    pytest.importorskip("transformers")
    from hyper_parallel.models.hf_zoo import tiny_hf_model

    model = tiny_hf_model("Qwen2MoeForCausalLM", experts_implementation="eager")
    ids = torch.randint(0, 256, (2, 8))
    with pytest.raises(ValueError) as info:
        capture(model, (), {"input_ids": ids, "labels": ids})
    message = str(info.value)
    assert "module 'model.layers.0.mlp.experts' (Qwen2MoeExperts)" in message
    assert "modeling_qwen2_moe.py" in message
    assert "model.set_experts_implementation('grouped_mm')" in message
