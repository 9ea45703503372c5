"""recording_reads and AttributeGuards (runtime/attribute_guards.py) on their own: which reads
become guards, that the classes are left as they were, and how variants are numbered."""

import dataclasses

import torch
import torch.nn as nn

from hyper_parallel.runtime.attribute_guards import AttributeGuards, recording_reads


@dataclasses.dataclass
class _Config:
    scale: float = 2.0
    mode: str = "a"
    unused: int = 7


class _Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.lin = nn.Linear(4, 4)
        self.toggled = False
        self.table = [1, 2]  # not a plain value: not guarded
        self.negate = False

    def forward(self, x):
        self.toggled = not self.toggled  # changed by the forward: not a fixed input
        _ = self.table
        y = self.lin(x) * self.config.scale * (1.0 if self.training else 0.5)
        return -y if self.negate or self.config.mode != "a" else y


def _record(model, x):
    reads = []
    with recording_reads(model, reads):
        model(x)
    return {label for _, _, label in reads}, reads


def test_plain_reads_of_modules_and_configs_are_recorded():
    model = nn.Sequential(_Block(_Config()), _Block(_Config(mode="b")))
    labels, _ = _record(model, torch.randn(2, 4))
    assert {"0.config.scale", "0.config.mode", "1.config.scale", "1.config.mode"} <= labels, labels
    assert "0.lin.in_features" not in labels  # nn.Linear's forward reads only its tensors
    # Not plain, changed by the forward, not read, nn.Module's machinery, or keyed already (training).
    assert not any(label.endswith(("toggled", "table", "unused", "_compiled_call_impl", "training"))
                   for label in labels), labels


def test_classes_are_restored_also_when_the_forward_raises():
    model = _Block(_Config(mode=object()))  # comparing with "a" works; the error comes after

    class Boom(RuntimeError):
        pass

    def failing(x):
        raise Boom()

    model.lin.forward = failing
    try:
        with recording_reads(model, []):
            model(torch.randn(2, 4))
    except Boom:
        pass
    for cls in (_Block, _Config, nn.Linear):
        assert "__getattribute__" not in cls.__dict__, cls


def test_variants_are_numbered_and_extended_with_new_guards():
    model = _Block(_Config())
    guards = AttributeGuards()
    _, reads = _record(model, torch.randn(2, 4))
    assert guards.variant()[0] == 0  # nothing guarded yet: the first program is variant 0
    guards.remember(guards.variant()[1])
    guards.add(reads)
    assert guards.variant()[0] == 0  # the first variant took the values the capture read
    model.config.scale = 3.0
    number, values = guards.variant()
    assert number == 1 and "config.scale 2.0 -> 3.0" in guards.changes(0, values)
    guards.remember(values)
    model.config.scale = 2.0
    assert guards.variant()[0] == 0
    model.config.scale = [2.0]  # replaced by a non-plain value: still compared, by what it prints
    number, values = guards.variant()
    assert number == 2 and "-> [2.0] (list)" in guards.changes(0, values)
    del model.negate
    assert "<root>.negate False -> <deleted>" in guards.changes(0, guards.variant()[1])
