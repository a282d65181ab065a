"""How long a literal a Lark or GBNF grammar makes llguidance build, read from its text before llguidance sees it.

llguidance joins a run of fixed strings into one lexeme: quoted strings side by side (`"ab" "cd"`), a rule or a
terminal that is one fixed string (`x: "ab"`, `X: /e{1000}/`), a group of them repeated an exact number of times
(`~N`, `{N}`) and the first N of a range (`~N..M`, `{N,M}`). A literal lexeme costs it about the square of its length
at every token, with none of its lexer fuel spent: `start: "a" | "b" ("e" * 1000)~20` costs 0.2 s of CPU at each
token once "b" is taken, `~99` 6 s, and the compile's probe, following the cheapest branch, never meets it. What
breaks a run, measured: an alternation of different strings (`"x" | "y"`, a class of more than one character, `\\d`,
`.`), an optional or unbounded part (`?`, `*`, `+`, `[...]` in Lark), the rest of a range. What does not: the same
string written twice or escaped (`"e" | "\\x65"`), a class of one character however written (`[e]`, `[e&&e]`,
`"e".."e"`), a lazy or a repeated count. So the longest run any rule spells out is computed here, reading strings,
escapes, counts and Rust's classes as llguidance does, and bounded (GrammarLimits.max_spelled); a rule that refers to
itself is not a fixed string (recursion is not inlined). This reader is a bound on what a grammar makes, kept in step
with llguidance's syntax by the attacks in tests/test_structured.py: llguidance's compiled grammar is not exposed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .grammar_worker import LARK_SYNTAX

MAX_NESTING = 100  # parentheses in one rule or regex (each a level of this reader's recursion)
MAX_COUNTS = 8  # counts on one item (`e{10}{10}`): more is no grammar a user writes, and each is read
CAP = 1_000_000  # a run this long is refused whatever the bound: the texts compared are held to it
LARK = re.compile(r"""
    (?P<space>\s+|//[^\n]*|->\s*[A-Za-z_]\w*)  # an alias names a tree node: nothing to the lexer
  | (?P<literal>"(?:[^"\\\n]|\\.)*"i?)
  | (?P<regex>/(?:[^/\\\n]|\\.)+/[imslux]*)
  | (?P<count>~\s*\+?\d+(?:\s*\.\.\s*\+?\d+)?|\{\s*\+?\d+\s*(?:,\s*\+?\d*\s*)?\})  # {N} too; Rust's i32 takes +N
  | (?P<quant>[*+?])
  | (?P<dots>\.\.)
  | (?P<name>!?[_?]?[a-z][_a-z0-9\-]*|_?[A-Z][_A-Z0-9\-]*)  # llguidance's lexer: `Ee` is E then e, `e-x` one name
  | (?P<open>\()
  | (?P<option>\[)
  | (?P<close>[)\]])
  | (?P<bar>\|)
  | (?P<other>.)
""", re.VERBOSE | re.DOTALL)
GBNF = re.compile(r"""
    (?P<space>\s+|\#[^\n]*)
  | (?P<literal>"(?:[^"\\\n]|\\.)*")
  | (?P<class>\[(?:[^\]\\\n]|\\.)*\]|\.)
  | (?P<count>\{\s*\d+\s*(?:,\s*\d*\s*)?\})
  | (?P<quant>[*+?])
  | (?P<name>[\w-]+)
  | (?P<open>\()
  | (?P<close>\))
  | (?P<bar>\|)
  | (?P<other>.)
""", re.VERBOSE | re.DOTALL)
REGEX = re.compile(r"""
    (?P<space>\(\?[a-zA-Z-]+\))  # inline flags: (?x), (?i)
  | (?P<class>\[(?:[^\[\]\\]|\\.|\[(?:[^\]\\]|\\.)*\])*\]|\\[pP](?:\{[^}]*\}|\w)|\\[dDwWsSbBhHvV]|\.)
  | (?P<char>\\[xu]\{[0-9a-fA-F]+\}|\\x[0-9a-fA-F]{2}|\\u[0-9a-fA-F]{4}|\\U[0-9a-fA-F]{8}|\\.|[^()|{}*+?\\\[^$])
  | (?P<count>\{\s*\d+\s*(?:,\s*\d*\s*)?\})
  | (?P<quant>[*+?])
  | (?P<open>\((?:\?(?:[:!=]|<[!=]|P?<\w+>|[a-zA-Z-]+:))?)
  | (?P<close>\))
  | (?P<bar>\|)
  | (?P<other>.)
""", re.VERBOSE | re.DOTALL)
ATTRIBUTES = r'(?:[ \t]*\[(?:[^\]"\n]|"(?:[^"\\\n]|\\.)*")*\])?'  # llguidance's [capture], [stop="]"], [lazy]
LARK_HEAD = re.compile(r"^[ \t]*!?\??(_?[a-z][_a-z0-9\-]*|_?[A-Z][_A-Z0-9\-]*)(?:[ \t]*\.[+-]?\d+)?" + ATTRIBUTES +
                       r"[ \t]*:", re.MULTILINE)
GBNF_HEAD = re.compile(r"^[ \t]*([\w-]+)[ \t]*::=", re.MULTILINE)
COUNT = re.compile(r"\d+")
DIRECTIVE = re.compile(r"^[ \t]*%.*$", re.MULTILINE)  # %import, %ignore, %llguidance: no rule's body
QUANTS = ("*", "+", "?")
STRINGS = r'"(?:[^"\\\n]|\\.)*"|\[(?:[^\]\\\n]|\\.)*\]'  # kept whole while comments are taken out
GBNF_COMMENT = re.compile(rf"({STRINGS})|#[^\n]*")  # to the line's end, inside a count too: `x{{#c\n99}}`
LARK_COMMENT = re.compile(rf"({STRINGS}|/(?:[^/\\\n]|\\.)+/)|//[^\n]*|#[^\n]*")
IMPORT = re.compile(r"^[ \t]*%import[ \t]+common(?:\.(\w+)(?:[ \t]*->[ \t]*(\w+))?|[ \t]*\(([^)]*)\))", re.MULTILINE)
COMMON = {"CR": "\r", "LF": "\n"}  # Lark's common terminals that are one fixed string (the others: classes, or runs)


def imports(text: str) -> dict[str, Spelled]:
    """The terminals a grammar imports from Lark's common set, under the names it gives them: CR and LF as their one
    character, every other one not fixed (classes such as DIGIT, runs such as WORD)."""
    found: dict[str, Spelled] = {}
    for m in IMPORT.finditer(text):
        pairs = [(m.group(1), m.group(2) or m.group(1))] if m.group(1) else [
            (n.strip(), n.strip()) for n in m.group(3).split(",") if n.strip()]
        for name, alias in pairs:
            found[alias] = Spelled(COMMON[name], 1) if name in COMMON else Spelled(None, 1)
    return found


@dataclass(frozen=True)
class Spelled:
    """What a rule, group or item spells: `fixed`, its one text where it is a fixed string (else None), and `run`, the
    longest run of fixed strings inside it, in UTF-8 bytes (its own length where it is fixed)."""

    fixed: str | None
    run: int


NOT_FIXED = Spelled(None, 0)


class Reader:
    """One grammar's rules, each read once into what it spells (memo), in an order where what a rule refers to is read
    before it (an explicit stack: a chain of a thousand rules recurses no Python frames); a rule still being read, a
    reference back to itself, counts as not fixed."""

    def __init__(self, text: str) -> None:
        lark = LARK_SYNTAX.search(text) is not None  # on the text as given, as llguidance decides
        text = text.replace("\r\n", "\n").replace("\r", "\n")  # llguidance ends a line (and a comment) at either
        self.tokens, heads = (LARK, LARK_HEAD) if lark else (GBNF, GBNF_HEAD)
        text = (LARK_COMMENT if lark else GBNF_COMMENT).sub(lambda m: m.group(1) or " ", text)
        imported = imports(text)
        text = DIRECTIVE.sub("", text)
        found = list(heads.finditer(text))
        self.bodies: dict[str, list[str]] = {}
        for m, nxt in zip(found, [*found[1:], None]):  # a name defined twice (a nested %lark): each definition
            self.bodies.setdefault(m.group(1), []).append(text[m.end():nxt.start() if nxt else len(text)])
        self.memo: dict[str, Spelled] = {name: spelled for name, spelled in imported.items() if name not in self.bodies}

    def longest(self) -> int:
        """The longest run of fixed strings any rule spells out."""
        for root in self.bodies:
            if root in self.memo:
                continue
            self.memo[root] = NOT_FIXED
            stack = [(root, iter(self.references(root)))]
            while stack:
                name, refs = stack[-1]
                child = next((r for r in refs if r in self.bodies and r not in self.memo), None)
                if child is not None:
                    self.memo[child] = NOT_FIXED  # on the stack: a reference back to it is recursion
                    stack.append((child, iter(self.references(child))))
                    continue
                stack.pop()
                self.memo[name] = max((self.read(body, self.tokens, 0) for body in self.bodies[name]),
                                      key=lambda spelled: spelled.run)
        return max((spelled.run for spelled in self.memo.values()), default=0)

    def references(self, name: str) -> list[str]:
        return [m.group().lstrip("!?") for body in self.bodies[name] for m in self.tokens.finditer(body)
                if m.lastgroup == "name"]

    def read(self, body: str, token: re.Pattern[str], depth: int) -> Spelled:
        if token is REGEX and VERBOSE.search(body):
            body = unverbose(body)
        tokens = [(m.lastgroup, m.group()) for m in token.finditer(body) if m.lastgroup not in ("space", "other")]
        return self.alternatives(tokens, [0], depth)

    def alternatives(self, tokens: list[tuple[str, str]], at: list[int], depth: int) -> Spelled:
        """The alternatives from tokens[at[0]] to the matching close (or the end); at[0] moves past them."""
        if depth > MAX_NESTING:
            raise ValueError(f"its parentheses nest over {MAX_NESTING} levels")
        alts: list[list[tuple[Spelled, tuple[str, ...]]]] = [[]]
        while at[0] < len(tokens):
            kind, value = tokens[at[0]]
            at[0] += 1
            if kind == "close":
                break
            if kind == "bar":
                alts.append([])
            elif kind in ("count", "quant", "dots"):
                if alts[-1]:
                    alts[-1][-1] = self.counted(alts[-1][-1], kind, value, tokens, at)
            else:
                alts[-1].append((self.item(kind, value, tokens, at, depth), ()))
        return join([alternative(items) for items in alts])

    def counted(self, last: tuple[Spelled, tuple[str, ...]], kind: str, value: str, tokens: list[tuple[str, str]],
                at: list[int]) -> tuple[Spelled, tuple[str, ...]]:
        """The last item with a count or quantifier added (a `?` after one is lazy: the same text), or a Lark range
        in its place (`"e".."e"` is the one character)."""
        item, counts = last
        if kind == "dots":
            end = tokens[at[0]][1] if at[0] < len(tokens) and tokens[at[0]][0] == "literal" else None
            at[0] += end is not None
            if end is None or item.fixed is None or len(item.fixed) != 1 or len(unescape_all(end[1:-1])) != 1:
                return Spelled(None, 1), counts
            low, high = ord(item.fixed), ord(unescape_all(end[1:-1]))  # "a".."z": a class, "e".."e" the e
            return (Spelled(item.fixed, utf8(item.fixed)) if low == high else Spelled(None, 1)), counts
        if value == "?" and counts:  # lazy
            return last
        if len(counts) == MAX_COUNTS:
            raise ValueError(f"an item carries over {MAX_COUNTS} counts or quantifiers")
        return item, (*counts, value)

    def item(self, kind: str, value: str, tokens: list[tuple[str, str]], at: list[int], depth: int) -> Spelled:
        """What one item spells (a group read to its close)."""
        if kind == "literal":
            text = unescape_all(value[1:-1] if value.endswith('"') else value[1:-2])  # "abc"i
            return Spelled(text, utf8(text))
        if kind == "char":  # a regex's character, maybe escaped
            char = unescape(value)
            return Spelled(char, utf8(char))
        if kind == "regex":
            body, flags = value[1:value.rindex("/")], value[value.rindex("/") + 1:]
            return self.read(unverbose(body) if "x" in flags else body, REGEX, depth + 1)
        if kind == "name":
            return self.memo.get(value.lstrip("!?"), NOT_FIXED)  # read before this rule (longest's order), or none
        if kind in ("open", "option"):
            inner = self.alternatives(tokens, at, depth + 1)
            return Spelled(None, inner.run) if kind == "option" else inner  # Lark's [...]: optional
        return as_character(value)  # a class


def alternative(items: list[tuple[Spelled, tuple[str, ...]]]) -> Spelled:
    """One alternative: its runs of fixed strings summed (exact counts repeat a fixed item inside the run, a range's
    first N end it, anything not fixed or optional ends it); fixed where every item is, counted exactly."""
    run, best, text = 0, 0, ""
    for spelled, counts in items:
        if spelled.fixed is None or any(c in QUANTS for c in counts):
            best, run, text = max(best, run, spelled.run), 0, None
            continue
        times, exact = 1, True
        for count in counts:  # e{1000}{1}: each count repeats what the one before made
            numbers = [int(n) for n in COUNT.findall(count)]
            times = min(times * min(numbers), CAP)
            exact = exact and is_exact(count)
        run = min(run + spelled.run * times, CAP)
        if exact:
            text = repeated(text, spelled.fixed, times)
        else:  # a range: its first `times` are joined, the rest ends the run
            best, run, text = max(best, run), 0, None
    return Spelled(text, max(best, run))


def is_exact(count: str) -> bool:
    """Whether a count (Lark's ~N or ~N..M, GBNF's or a regex's {N}, {N,M} or {N,}) is one number of times."""
    numbers = COUNT.findall(count)
    return len(set(numbers)) == 1 and (len(numbers) == 2 or not re.search(r"\.\.|,", count))


def as_character(token: str) -> Spelled:
    """A class (`[...]`, `.`, `\\d`, a Lark range): the one character it matches, where it matches one (llguidance
    makes `[e]`, `[e-e]`, `[e&&e]`, `[[e]]` the literal e, and joins it into a run), else not fixed (one byte of a
    run it ends). A class this reader cannot read counts as a fixed character (an upper bound)."""
    try:
        members, end = class_members(token, 0) if token.startswith("[") else ([], 0)
    except (IndexError, ValueError):
        return Spelled("\0" + token, 4)
    if token.startswith("[") and end == len(token) and sum(hi - lo + 1 for lo, hi in members) == 1:
        char = chr(members[0][0])
        return Spelled(char, utf8(char))
    return Spelled(None, 1)


MAX_CODE = 0x10FFFF
PERL = {"d": [(0x30, 0x39)], "w": [(0, MAX_CODE)], "s": [(0, MAX_CODE)]}  # \\d as ASCII digits: enough to count


def class_members(text: str, at: int) -> tuple[list[tuple[int, int]], int]:
    """The code point ranges of the Rust regex class starting at text[at] ("["), and where it ends: nested classes,
    ranges, escapes, and `&&`, `--`, `~~` between sets (as regex-syntax reads them)."""
    at += 1
    negated = text.startswith("^", at)
    at += negated
    result: list[tuple[int, int]] | None = None
    operator, current, first = "", [], True  # current: list[tuple[int, int]]
    while not (text[at] == "]" and not first):
        first = False
        if text.startswith(("&&", "--", "~~"), at):
            result, operator, current = combine(result, operator, current), text[at:at + 2], []
            at += 2
        elif text.startswith("[:", at):  # [:alpha:]
            current.append((0, MAX_CODE))
            at = text.index(":]", at) + 2
        elif text[at] == "[":
            inner, at = class_members(text, at)
            current.extend(inner)
        else:
            low, at = class_char(text, at)
            if isinstance(low, list):
                current.extend(low)
            elif text[at] == "-" and text[at + 1] != "]" and not text.startswith("--", at):
                high, at = class_char(text, at + 1)
                current.append((low, high if isinstance(high, int) else MAX_CODE))
            else:
                current.append((low, low))
    result = combine(result, operator, current)
    return (complement(result) if negated else result), at + 1


def class_char(text: str, at: int) -> tuple[int | list[tuple[int, int]], int]:
    """One character of a class (its code point) or a Perl class inside it (its ranges), and where it ends."""
    if text[at] != "\\":
        return ord(text[at]), at + 1
    m = re.compile(r"\\(?:x\{([0-9a-fA-F]+)\}|u\{([0-9a-fA-F]+)\}|x([0-9a-fA-F]{2})|u([0-9a-fA-F]{4})|"
                   r"U([0-9a-fA-F]{8})|([dDwWsS])|[pP](?:\{[^}]*\}|\w)|(.))", re.DOTALL).match(text, at)
    if m is None:
        raise ValueError("an escape this reader does not know")
    code = next((g for g in m.groups()[:5] if g), None)
    if code is not None:
        return min(int(code, 16), MAX_CODE), m.end()
    if m.group(6):
        letter = m.group(6)
        return (PERL[letter] if letter.islower() else complement(PERL[letter.lower()])), m.end()
    if m.group(7) is not None:
        return ord(SIMPLE_ESCAPES.get(m.group(7), m.group(7))), m.end()
    return [(0, MAX_CODE)], m.end()  # \\p{...}: many


def combine(left: list[tuple[int, int]] | None, operator: str, right: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """left OPERATOR right for code point sets (no operator yet: right)."""
    if left is None or not operator:
        return merged(right)
    if operator == "&&":
        return intersect(left, right)
    if operator == "--":
        return intersect(left, complement(right))
    return merged([*intersect(left, complement(right)), *intersect(right, complement(left))])  # ~~


def merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for low, high in sorted(r for r in ranges if r[0] <= r[1]):
        if out and low <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], high))
        else:
            out.append((low, high))
    return out


def complement(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out, start = [], 0
    for low, high in merged(ranges):
        if low > start:
            out.append((start, low - 1))
        start = high + 1
    return [*out, (start, MAX_CODE)] if start <= MAX_CODE else out


def intersect(left: list[tuple[int, int]], right: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Both sets' common ranges, in one pass over the two sorted lists (a class may hold thousands of ranges)."""
    a, b, out, i, j = merged(left), merged(right), [], 0, 0
    while i < len(a) and j < len(b):
        low, high = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if low <= high:
            out.append((low, high))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def unescape(char: str) -> str:
    """A regex's or class's one character, its escape read (`\\x65`, `\\u{65}`: e)."""
    if m := re.fullmatch(r"\\[xuU]\{?([0-9a-fA-F]+)\}?", char):
        code = int(m.group(1), 16)
        return chr(code) if code < 0x110000 else "\ufffd"
    return char[-1]


STRING_ESCAPE = re.compile(r"\\(?:x[0-9a-fA-F]{2}|u\{[0-9a-fA-F]+\}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|.)", re.DOTALL)
SIMPLE_ESCAPES = {"n": "\n", "t": "\t", "r": "\r"}


def unescape_all(text: str) -> str:
    """A quoted string's text with its escapes read (`"\\x65"` is "e", as llguidance reads it)."""
    def one(m: re.Match[str]) -> str:
        escape = m.group()
        return SIMPLE_ESCAPES.get(escape[1], escape[1]) if len(escape) == 2 else unescape(escape)

    return STRING_ESCAPE.sub(one, text)


VERBOSE = re.compile(r"\(\?[a-wyz]*x")  # (?x) or (?ix): whitespace and # comments are not the regex's
def unverbose(body: str) -> str:
    """A verbose regex without its whitespace and comments (escapes and classes kept)."""
    return re.sub(r"(\\.|\[(?:[^\]\\]|\\.)*\])|\s+|#[^\n]*", lambda m: m.group(1) or "", body)


def utf8(text: str) -> int:
    """A text's length in UTF-8 bytes, the unit llguidance's lexer reads (a 4-byte character costs four)."""
    return len(text.encode("utf-8", "surrogatepass"))


def exact(count: str) -> bool:
    """Whether a count (Lark's ~N or ~N..M, GBNF's or a regex's {N}, {N,M} or {N,}) is one number of times."""
    numbers = COUNT.findall(count)
    return not numbers or len(set(numbers)) == 1 and (len(numbers) == 2 or not re.search(r"\.\.|,", count))


def repeated(text: str | None, fixed: str, times: int) -> str | None:
    """text + fixed * times, or None where either is past CAP (the run's length is what is bounded)."""
    if text is None or len(text) + len(fixed) * times > CAP:
        return None
    return text + fixed * times


def join(alts: list[Spelled]) -> Spelled:
    """Alternatives together: a fixed string only where every one is the same string (llguidance joins `"e" | "e"`,
    and `"e" | "\\x65"`, whose escapes are read), else the longest run inside any of them."""
    texts = {a.fixed for a in alts}
    fixed = alts[0].fixed if len(texts) == 1 else None
    return Spelled(fixed, max(a.run for a in alts))


def longest_literal(text: str) -> int:
    """The longest literal lexeme (a run of fixed strings) the grammar makes llguidance build, in UTF-8 bytes; ValueError
    where its parentheses nest over MAX_NESTING levels."""
    return Reader(text).longest()


def regex_length(pattern: str) -> int:
    """The longest run of fixed text in a regex (`e{1000}` a thousand; a class, `*` or `|` ends a run); ValueError
    where its parentheses nest over MAX_NESTING levels."""
    return Reader("").read(pattern, REGEX, 0).run
