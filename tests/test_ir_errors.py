"""dsl.parse_ir: syntax errors in the IR text, worded like the spec's."""
import pytest

import dsl


def test_parse_ir_syntax_errors_are_worded_and_kernel_ir_is_named():
    with pytest.raises(dsl.MtcError, match=r"<ir>:1:1: error: this is kernel IR \(the 'lowered' stage"):
        dsl.parse_ir("kernels tiny(B, T) target=triton {\n}\n")
    with pytest.raises(dsl.MtcError, match=r"<ir>:3:1: error: syntax error in IR: unexpected '}'; expected '%'"):
        dsl.parse_ir("graph g(B, T) {\n  %0 = add(%a, \n}")
