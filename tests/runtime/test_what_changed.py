"""runtime/recompiles.what_changed: how a recompile's reason is worded."""

from hyper_parallel.runtime.recompiles import ProgramKey, what_changed


def _key(signatures, attributes=0, backward=True) -> ProgramKey:
    return ProgramKey("spec", signatures, (), "{}", (), (), (), attributes, backward)


TENSOR = ("tensor", (2, 16), "torch.int64", False, "cpu")


def test_a_changed_python_number_says_to_pass_a_tensor():
    """HF Trainer's ``num_items_in_batch`` as an int compiles a program per value: the log says why
    and what to do."""
    text = what_changed(_key((TENSOR, ("const", "int", "20"))), _key((TENSOR, ("const", "int", "25"))),
                        ["input_ids", "num_items_in_batch"])
    assert text == ("input 'num_items_in_batch': int 20 -> int 25 (a Python number is part of the program: "
                    "pass a tensor to reuse one program for every value)")
    flag = what_changed(_key((("const", "bool", "True"),)), _key((("const", "bool", "False"),)), ["return_dict"])
    assert flag == "input 'return_dict': bool True -> bool False"  # a switch: no hint


def test_attributes_and_grad_mode_are_worded():
    changed = what_changed(_key((TENSOR,)), _key((TENSOR,), attributes=1), ["input_ids"], "m.p 0.0 -> 0.1")
    assert changed == "module attributes the program reads: m.p 0.0 -> 0.1"
    grad = what_changed(_key((TENSOR,), backward=False), _key((TENSOR,)), ["input_ids"])
    assert "compiled under torch.no_grad() (without backward)" in grad
