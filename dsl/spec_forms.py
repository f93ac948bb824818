"""How each op is written in a ``.mtc`` spec, for ``mtc ops``: each op's :class:`SpecForm` lives in its declaration
(``register(..., spec=SpecForm(...))`` in dsl/ops/<family>.py); this module is the table of them by op name.

In a spec, an op that owns parameters creates them itself, sized by keywords and named by ``name=`` (their
state-dict prefix): ``y = linear(x, out=N, name="proj")``, while its graph signature lists the parameters as inputs
(``linear(x, weight)``). ``SpecForm(form, notes, example)``: ``form`` is None for ops a spec cannot write (the
two-phase AttnRes ops made by a pass; the multi-output ``qb_route``); ``example`` is a whole spec that builds
(``tests/test_cli.py`` loads every example, runs ``mtc stats`` and ``mtc ir`` at every ``--stage`` on it and
compiles it for the reference and Triton targets). ``stack`` is a spec statement, not a graph op: :data:`STACK`.
"""
from __future__ import annotations

from collections.abc import Mapping

from .ops import OPS, STACK, SpecForm  # noqa: F401  (re-exported)


class _SpecForms(Mapping):
    """The registered ops' spec forms by op name (read from the registry on each access)."""

    def __getitem__(self, name: str) -> SpecForm:
        return OPS[name].spec

    def __iter__(self):
        return iter(OPS)

    def __len__(self) -> int:
        return len(OPS)


SPEC_FORMS: Mapping[str, SpecForm] = _SpecForms()
