"""The engine's exception types: one line of text that names what was wrong and what was expected."""


def one_line(text: object, limit: int = 200) -> str:
    """`text` (often another library's message, of many lines) on one line of at most `limit` characters, cut
    between words with "..." where it is longer."""
    flat = " ".join(str(text).split())
    if len(flat) <= limit:
        return flat
    cut = flat[: limit - 4]
    if flat[len(cut)] != " " and " " in cut:  # the cut ends inside a word: drop that word
        cut = cut.rsplit(" ", 1)[0]
    return cut + " ..."


class GPT2EngineError(Exception):
    """Base class; the CLI prints the message as one line and exits 2."""


class WeightsError(GPT2EngineError):
    """A checkpoint directory or weights file that cannot be loaded as GPT-2."""


class TokenizerError(GPT2EngineError):
    """Missing, corrupt or inconsistent BPE files."""


class GenerationError(GPT2EngineError, ValueError):
    """Invalid sampling settings or a prompt that does not fit the context. `param` names the setting at fault
    (the server reports it as the OpenAI error's "param")."""

    def __init__(self, message: str, param: str | None = None, advice: str = "") -> None:
        super().__init__(f"{message}; {advice}" if advice else message)
        self.param = param
        self.bare = message  # without the advice for the command line and the Python API, which a server leaves out


class SteeringError(GenerationError):
    """A steering edit that does not fit the model, or a file or spec that does not say one (param "steering")."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="steering")


class DownloadError(GPT2EngineError):
    """The hub could not be reached, a file was missing, or a download failed verification."""


class InputError(GPT2EngineError):
    """An input file that cannot be read: missing, unreadable, larger than its kind can be, or not what it holds."""
