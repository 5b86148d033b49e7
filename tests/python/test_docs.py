"""The examples in cfc's docstrings run and print what they say."""

import doctest

import cfc
import cfc.checkpoint
import cfc._gpu
import cfc.codec
import cfc.compat
import cfc.ddp
import cfc.distributed
import cfc.fsdp


def test_docstring_examples():
    # Examples that need a process group or GPUs are marked `# doctest: +SKIP` line by line
    # (doctest knows no other skip marker), and are still parsed here.
    for module in (cfc, cfc.codec, cfc._gpu, cfc.checkpoint, cfc.compat, cfc.ddp, cfc.distributed, cfc.fsdp):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0, f"{result.failed} doctest failure(s) in {module.__name__}"
        assert result.attempted > 0 or module not in (cfc, cfc.codec)
