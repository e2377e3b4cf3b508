"""Policy operators: ``&``, ``|`` and ``~`` take every form a policy takes."""

from __future__ import annotations


def test_operators_take_every_form_as_policy_takes():
    from torch import nn

    from ckptwrap.policy import Last, Type, as_policy

    assert Type("Linear") & "last:2" == as_policy("type:Linear;last:2")
    assert "type:Linear" & Last(2) == as_policy("type:Linear;last:2")
    union = Last(1) | nn.Linear
    assert union.parts == (Last(1), as_policy(nn.Linear))
