"""One translator from what torch raises (or records) while capturing a draft to the DraftCaptureError
a draft's author should get: the cause in plain words, the user's file:line, a fix that fits a draft.

`draft_loop`, `fold` and `explain` (which traces as draft_loop compiles) translate the exceptions of a
compile (`from_exception`), so they agree. Dynamo's own hints
are not repeated: for a host read they suggest tracing the read into the graph
(capture_scalar_outputs), which still syncs with the host on every call; a draft needs the value kept
on the device, a padded static size, or the work moved after the draft.
"""

from __future__ import annotations

import linecache
import os
import re
import sysconfig

import torch
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from draftfuse.runtime.checks import DATA_DEPENDENT_FIX, HOST_SYNC_FIX
from draftfuse.runtime.errors import CudagraphSkipError, DraftCaptureError, GraphBreakError, HostSyncError, RecompileError, causes, first_line

SKIP_MESSAGE = "skipping cudagraphs due to"
NO_FRAMES_MESSAGE = "found no compiled frames"
_HOST_READ = re.compile(
    r"\b(item|tolist|numpy|nonzero|unique|_local_scalar_dense|data-dependent|data dependent|dynamic shape operator)\b"
    r"|depends on (the )?input data",
    re.I,
)
_CONFIG_ADVICE = re.compile(r"\s*\(?\b(with|set|setting)?\s*(torch\._dynamo\.config\.)?capture_\w+\s*=\s*\w+\)?", re.I)
_BRANCH = re.compile(r"branch|jump|if statement|control flow", re.I)
_BRANCH_FIX = "compute both sides and pick with torch.where (or use torch.cond): a draft must not decide on the host"
# a Python decision (if, bool(), a comparison) on a value read from a tensor, traced as a symbol (u0 > 5)
_UNBOUND = re.compile(r"failed to bind arguments|argument mismatch", re.I)  # a call whose arguments do not bind
FOLD_LOOP_CALL = "_df_loop_("  # how fold's generated composition calls the loop (a line of its source)
_DECISION = re.compile(r"guard on data-dependent expression", re.I)
# ... raised inside a torch op (torch 2.11's split by a count read from a tensor guards in its decomposition),
# not by Dynamo evaluating the draft's own if/bool()/comparison: a size, not a decision
_GUARD_IN_AN_OP = re.compile(r"^Caused by: .*\((?!_dynamo/)[\w/.-]+\.py:\d+ in \w+\)\s*$", re.M)
# x[0, t[0]] with t[0] a 0-d tensor; with size-like symbols it is a data-dependent size (split(x, n_nonzero))
_AS_INT = re.compile(r"extract specialized integer from data-dependent expression.*Size-like symbols: none", re.I | re.S)
# torch 2.11: a host read used as an index reaches the fake tensor as a SymInt, which indexing refuses
# (x[0, t[0, 0].item() % 3]); a 0-d tensor index raises _AS_INT's message as a UserError
_SYMINT_INDEX = re.compile(r"valid indices \(got SymInt\)")
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")  # torch 2.11's error under inference_mode is a weakref's repr
_INFERENCE_VERSION = re.compile(r"version_counter for inference tensor")  # torch 2.11-2.13 under inference_mode


_NOT_USER_CODE = (os.path.dirname(torch.__file__), sysconfig.get_paths()["stdlib"])


def _in_fold_calling_the_loop(where: str) -> bool:
    """Whether `where` (file:line) is the line of fold's generated composition that calls the loop."""
    filename, _, line = where.rpartition(":")
    return "<fold of " in filename and line.isdigit() and FOLD_LOOP_CALL in linecache.getline(filename, int(line))


def _location(exc: BaseException) -> str:
    # the innermost frame of the user's code (torch 2.11 ends some stacks in a Dynamo polyfill or the stdlib)
    stack = [frame for frame in getattr(exc, "real_stack", None) or () if not frame.filename.startswith(_NOT_USER_CODE)]
    if stack:
        return f"{stack[-1].filename}:{stack[-1].lineno}"
    matches = re.findall(r'File "([^"]+)", line (\d+)', str(exc))
    return f"{matches[-1][0]}:{matches[-1][1]}" if matches else ""


def _classify(title: str, explanation: str, where: str, first_host_read: str = "", raised: str = "",
              raised_type: type | None = None) -> DraftCaptureError:
    """The error for a graph break or tracing failure described by Dynamo's title and explanation (`raised`:
    the exception the traced draft raised, as Dynamo shows it; `raised_type`: its class, when known)."""
    title = _CONFIG_ADVICE.sub("", title).strip()  # "... call with capture_scalar_outputs=False": not a fix for a draft
    text = f"{title} {explanation}"
    # "Data-dependent assertion failed", "Assertion failed on symbolic shapes"; "Observed exception": a raise
    if re.search(r"assertion failed|observed exception", title, re.I):
        what = f"the draft raises {raised}" if raised else "an `assert` (or a `raise`) in the draft fails"
        return _also_raised(raised_type)(
            f"{what} for this call's arguments when traced (their shapes or Python values: eager raises there too), "
            "or its condition reads a device value",
            where=where,
            fix="check the arguments before calling the draft, or assert on tensors inside it with torch._assert_async",
        )
    if _UNBOUND.search(text):
        loop = _in_fold_calling_the_loop(where)
        return GraphBreakError(
            ("the loop does not take the values the seed returns (loop(*seed(...)) raises TypeError eagerly)" if loop
             else "a call whose arguments do not fit the parameters of the function it calls, as Dynamo binds them") + f": {explanation or title}",
            where=where,
            fix="make the seed return what the loop takes, in order (a tuple is passed as separate arguments)" if loop
            else "call it with the arguments it takes",
        )
    if _BRANCH.search(title):
        return GraphBreakError(f"graph break: {title}" + (f" ({explanation})" if explanation else ""), where=where, fix=_BRANCH_FIX)
    if _HOST_READ.search(text):
        cause = f"graph break: {title}: reads a device value on the host"
        if first_host_read and first_host_read != where:
            cause += f" (the data-dependent value comes from {first_host_read})"
        fix = DATA_DEPENDENT_FIX if re.search(r"data.dependent|unique|nonzero|tolist|dynamic shape|input data", text, re.I) else HOST_SYNC_FIX
        return HostSyncError(cause, where=first_host_read or where, fix=fix)
    if _LOGGER.search(text):
        fix = "move the logging out of the draft (log what it returns, after the call): Dynamo traces no logging.Logger method"
    elif "super().__init__" in text:  # most often an exception class of the draft's, being raised
        fix = ("give the class no __init__ of its own that calls super().__init__(...) (an exception class: set its "
               "attributes after making it), or make the object outside the draft")
    elif _PRINT_OR_WARN.search(text):
        fix = ("move the call out of the draft, or add the function to torch._dynamo.config.reorderable_logging_functions "
               "(Dynamo then calls it after the graph, with the values it was given)")
    else:
        fix = "move this call out of the draft (before or after it), or make it traceable: torch.compiler.allow_in_graph, or a torch.library custom op"
    return GraphBreakError(f"graph break: {title}" + (f" ({explanation})" if explanation else ""), where=where, fix=fix)


_LOGGER = re.compile(r"logging\.Logger method")
_PRINT_OR_WARN = re.compile(r"`(_warnings\.warn|builtins\.print|print)`|builtin print")


def _skip_error(text: str) -> CudagraphSkipError:
    reason = text[text.index(SKIP_MESSAGE) + len(SKIP_MESSAGE) :].strip().splitlines()[0].rstrip(".:")
    matches = re.findall(r'File "([^"]+)", line (\d+)', text)
    return CudagraphSkipError(
        f"Inductor skips CUDA graphs for this draft: {reason}",
        where=f"{matches[-1][0]}:{matches[-1][1]}" if matches else "",
        fix="make the draft's inputs device tensors of fixed shape, and mark tensors it writes in place "
        "static (torch._dynamo.mark_static_address)",
    )


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]



def _explanation(lines: list[str]) -> str:
    """What Dynamo's message says under "Explanation:" ("" if nothing)."""
    return next((ln.removeprefix("Explanation:").strip() for ln in lines if ln.startswith("Explanation:")), "")


def from_exception(exc: BaseException, first_host_read: str = "") -> DraftCaptureError | None:
    """The DraftCaptureError that `exc` (raised by a draft's compile or call) stands for; None for an
    error that is torch's own (a bug to report) rather than the draft's. `first_host_read` is the
    file:line of the draft's first data-dependent value, where the caller found it."""
    if isinstance(exc, torch._dynamo.exc.BackendCompilerFailed) and not is_inductor_error(exc):
        exc = exc.inner_exception  # the backend's own error, raised while compiling (Inductor's is one too)
    if isinstance(exc, DraftCaptureError):
        return exc
    if isinstance(exc, torch._dynamo.exc.FailOnRecompileLimitHit):
        return RecompileError(
            "torch's recompile limit was reached for the draft's code (torch._dynamo.config.recompile_limit)",
            fix="pass the values that change as tensors, keep shapes fixed, or raise max_compiles",
        )
    if _SYMINT_INDEX.search(str(exc)) or (isinstance(exc, torch._dynamo.exc.UserError) and _AS_INT.search(str(exc))):
        return _used_as_an_int(first_line(str(exc), type(exc).__name__), _location(exc) or first_host_read)  # torch 2.11's forms
    if is_data_dependent(exc):
        if _DECISION.search(str(exc)) and not _GUARD_IN_AN_OP.search(str(exc)):
            read = f" read at {first_host_read}" if first_host_read else ""
            return HostSyncError(f"a Python decision (an if, bool(), a comparison) on a value{read} from a tensor: the "
                                 "host would wait for the device", where=_location(exc) or first_host_read, fix=_BRANCH_FIX)
        title = first_line(str(exc), type(exc).__name__)
        if _AS_INT.search(str(exc)):
            return _used_as_an_int(title, _location(exc) or first_host_read)
        return _classify(f"data-dependent value read on the host ({title})", "", _location(exc), first_host_read)
    if isinstance(exc, (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError)):
        text = str(getattr(exc, "msg", "") or exc)
        lines = _lines(text)
        title = getattr(exc, "gb_type", "") or (lines[0] if lines else type(exc).__name__)
        return _classify(title, _explanation(lines), _location(exc), first_host_read, *_raised(exc))
    if SKIP_MESSAGE in str(exc):
        return _skip_error(str(exc))
    if NO_FRAMES_MESSAGE in str(exc):  # Dynamo skipped the draft's frame whole (under a TorchDispatchMode, say)
        skipped = re.search(r"^\s*- \S+ \(([^()]+:\d+)\): (.+)$", str(exc), re.M)
        return skipped_error(skipped.group(2) if skipped else first_line(str(exc), type(exc).__name__), skipped.group(1) if skipped else "")
    if _INFERENCE_VERSION.search(str(exc)):
        return inference_mode_error(exc)
    if is_inductor_error(exc):
        return DraftCaptureError(
            f"torch's compiler (Inductor) failed on this draft: {first_line(str(exc), type(exc).__name__)}",
            where=_location(exc),
            fix="run the draft eagerly with the same arguments: if it raises there too (a shape that does not "
            "broadcast, say), that is the error, which Inductor met first; if not, it is a torch bug: report it to "
            "PyTorch with the draft (the cause below has torch's own error), and meanwhile compile the draft without "
            "the construct that triggers it, or with options that avoid it",
        )
    if isinstance(exc, torch._dynamo.exc.TorchRuntimeError):
        op_error = _op_error(exc)  # the op's own error (a dtype mismatch), under Dynamo's "when making fake tensor call"
        return DraftCaptureError(
            f"the draft raised an error while traced: {op_error or first_line(str(exc), type(exc).__name__)}",
            where=_location(exc),
            fix="run the draft eagerly with the same arguments: if it raises there too, that is the error; if not, "
                "the draft catches it (a try/except around a tensor op), which a traced draft cannot: check the "
                "condition before the op instead",
        )
    if isinstance(exc, (IndexError, TypeError)) and "SymInt" in str(exc) and _location(exc):
        return _used_as_an_int(first_line(str(exc), type(exc).__name__), _location(exc))
    return None


def inference_mode_error(exc: BaseException) -> DraftCaptureError:
    """torch 2.11-2.13 fail to compile in-place writes under torch.inference_mode() (2.13: "Cannot set
    version_counter for inference tensor"; 2.11: a RuntimeError whose message is a storage's weakref)."""
    return DraftCaptureError(
        "torch cannot compile this draft under torch.inference_mode(): its compiler failed on the draft's "
        f"inference tensors ({type(exc).__name__}: {_ADDRESS.sub('', first_line(str(exc), ''))}); plain torch.compile fails the same way",
        where=_location(exc),
        fix="use torch.no_grad() where the draft uses or is called under torch.inference_mode() (draft_loop "
        "runs it without grad anyway)",
    )


def skipped_error(reason: str, where: str) -> DraftCaptureError:
    """Dynamo skipped the draft's frame whole (`reason`): it would run eagerly, not as one compiled region."""
    return DraftCaptureError(
        f"torch.compile skipped the draft: {reason}",
        where=where,
        fix="call the draft outside what makes Dynamo skip it (a TorchDispatchMode it runs under, say): eager "
        "runs it there, a compiled draft cannot",
    )


def _used_as_an_int(detail: str, where: str) -> HostSyncError:
    """A value read from a tensor used where Python needs an int: an index (x[0, t[0]], x[t.item()])."""
    return HostSyncError(
        f"a value read from a tensor is used as a Python int (an index such as x[0, t[0]] or x[t.item()]): {detail}",
        where=where,
        fix="keep it a tensor (index with a tensor of one or more dims: x[0, t[:1]], or torch.gather)",
    )


def is_inductor_error(exc: BaseException) -> bool:
    return type(exc).__name__ == "InductorError"  # torch._inductor.exc's; a BackendCompilerFailed on torch 2.13


def _op_error(exc: BaseException) -> str:
    """The first error in `exc`'s causes that is not one of Dynamo's ("RuntimeError: expected scalar type
    Double but found Float"), or ""."""
    found = next((e for e in causes(exc) if e is not exc and not type(e).__module__.startswith("torch._dynamo")), None)
    return f"{type(found).__name__}: {first_line(str(found), '')}".rstrip(": ") if found is not None else ""


def _raised(exc: BaseException | None) -> tuple[str, type | None]:
    """The exception the traced draft raised, as Dynamo shows it (MyError('steps must be >= 1, got 0'), or
    its type's name) and its class; ("", None) if none."""
    observed = next((e for e in causes(exc, lambda e: e.__cause__) if isinstance(e, torch._dynamo.exc.ObservedException)), None)
    if observed is None:
        return "", None
    kind = next((kind for kind, as_observed in torch._dynamo.exc.observed_exception_map.items() if as_observed is type(observed)), None)
    message = observed.args[0] if observed.args else ""
    if kind is not None and hasattr(message, "as_python_constant"):  # torch._check's message: a traced str
        try:
            return f"{kind.__name__}({message.as_python_constant()!r})", kind
        except Exception:
            pass
    text = str(message)
    if text.startswith("raised exception "):
        # an object formatted into the message shows as Dynamo's variable of it: the object's class's name
        shown = re.sub(r"\b\w*Variable\((\w+)\)", r"<\1>", text.removeprefix("raised exception "))
        if re.match(r"\w+\(", shown) and "Variable(" not in shown:
            return shown, kind
    return (kind.__name__ if kind else ""), kind


_RAISED_KINDS: dict[type, type] = {}


def _also_raised(kind: type | None) -> type:
    """GraphBreakError, made a subclass of `kind` too (the exception the draft raised, which eager raises
    there as well), so that `except ValueError:` around the draft's call still catches it. Only the class:
    the error is built as a GraphBreakError (kind's own __init__ does not run). Plain GraphBreakError for
    no kind, an exception that is not an Exception's subclass (SystemExit...) or a class that refuses a
    common subclass (an instance layout of its own, such as OSError's; its metaclass or __init_subclass__)."""
    if kind is None or not issubclass(kind, Exception) or issubclass(kind, DraftCaptureError):
        return GraphBreakError
    if kind not in _RAISED_KINDS:
        try:
            both = type("GraphBreakError", (GraphBreakError, kind), {
                "__module__": GraphBreakError.__module__,
                "__reduce__": lambda self: (_raised_error, (kind, self.cause, self.where, self.fix)),  # picklable
                "__str__": BaseException.__str__,  # the message, not KeyError's repr of it
            })
            both.__qualname__ = f"GraphBreakError[{kind.__name__}]"
        except Exception:  # TypeError for the layouts; a metaclass or __init_subclass__ of the user's may refuse
            both = GraphBreakError
        _RAISED_KINDS[kind] = both
    return _RAISED_KINDS[kind]


def _raised_error(kind: type, cause: str, where: str, fix: str) -> GraphBreakError:
    return _also_raised(kind)(cause, where=where, fix=fix)


def is_data_dependent(exc: BaseException) -> bool:
    """Whether `exc` (or what it wraps) is a failure to read a data-dependent value at trace time."""
    for e in causes(exc, lambda e: getattr(e, "inner_exception", None) or e.__cause__):
        if isinstance(e, GuardOnDataDependentSymNode) or type(e).__name__ in ("DataDependentOutputException", "DynamicOutputShapeException"):
            return True
        if isinstance(e, torch._dynamo.exc.UserError) and _DECISION.search(str(e)):
            return True
    return False

