"""vtool: an ahead-of-time LLM compiler on Apache TVM and the runtime that serves its output.

The repository root is this package; each top-level folder is a subpackage
(vtool.targets, vtool.models, vtool.schedules, vtool.toolchain, vtool.runtime).
Importing `vtool` must stay cheap: nothing here pulls in TVM.
"""

__version__ = "0.1.0"


class VtoolError(Exception):
    """An error the user can act on: it names what was seen and what is accepted.

    The CLI prints these as one clear line instead of a traceback.
    """


def __getattr__(name: str):
    # Lazy, so `import vtool` stays cheap and runtime-only code never loads the compiler.
    if name == "LLM":
        from vtool.toolchain.api import LLM

        return LLM
    if name == "SamplingParams":
        from vtool.runtime.sampling.params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'vtool' has no attribute {name!r}")
