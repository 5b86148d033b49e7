"""The examples in cfc's docstrings run and print what they say."""

import doctest

import cfc
import cfc.codec


def test_docstring_examples():
    for module in (cfc, cfc.codec):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0, f"{result.failed} doctest failure(s) in {module.__name__}"
        assert result.attempted > 0 or module is not cfc.codec
