"""dsl.parse_ir: syntax errors in the IR text, worded like the spec's."""
import pytest

import dsl


def test_parse_ir_syntax_errors_are_worded_and_kernel_ir_is_named():
    with pytest.raises(dsl.MtcError, match=r"<ir>:1:1: error: this is kernel IR \(the 'lowered' stage"):
        dsl.parse_ir("kernels tiny(B, T) target=triton {\n}\n")
    with pytest.raises(dsl.MtcError, match=r"<ir>:3:1: error: syntax error in IR: unexpected '}'; expected '%'"):
        dsl.parse_ir("graph g(B, T) {\n  %0 = add(%a, \n}")


def test_parse_ir_refuses_duplicate_input_and_state_names():
    """Two inputs with one name (both fed by m.run(x=...)) or two parameters with one state-dict key: an error at
    the second, naming the first (new-user trial, 16th session: the IR took them; the spec refuses the same)."""
    base = ('graph g(B) {\n  %x = input {name = "x"} : f32[B, 8]\n  %w = param {init = "ones", name = "n.weight"} : '
            'f32[8]\n  %y = rmsnorm(%x, %w) {eps = 1e-06} : f32[B, 8]\n  return %y\n}\n')
    g = dsl.parse_ir(base)
    assert [n.attr("name") for n in g.inputs()] == ["x"]
    with pytest.raises(dsl.MtcError, match=r"<ir>:3:3: error: %z: input name 'x' is already the name of %x "
                                           r"\(line 2\)"):
        dsl.parse_ir(base.replace('  %w =', '  %z = input {name = "x"} : f32[B, 8]\n  %w =', 1))
    with pytest.raises(dsl.MtcError, match=r"<ir>:4:3: error: %v: param name 'n.weight' is already the name of %w "
                                           r"\(line 3\); parameters and buffers are state-dict keys"):
        dsl.parse_ir(base.replace('  %y =', '  %v = param {init = "ones", name = "n.weight"} : f32[8]\n  %y =', 1))
    # an input and a parameter may share a name (different namespaces)
    dsl.parse_ir(base.replace('name = "n.weight"', 'name = "x"'))
