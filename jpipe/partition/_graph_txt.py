"""PipeDream's profile format (``graph.txt``) as a cost graph.

One line per node, then one line per edge (edges start with a tab)::

  nodeK -- Desc -- forward_compute_time=F, backward_compute_time=B,
      activation_size=A, parameter_size=P
  \\tnodeI -- nodeJ

F and B are milliseconds, A and P bytes (A may be a list ``[a1; a2]`` for
several outputs, summed here).
"""

import dataclasses
import heapq
import itertools
import os
import re

import numpy as np

_NODE = re.compile(
  r"^(?P<name>\S+) -- (?P<desc>.*) -- forward_compute_time=(?P<f>[^,]+), "
  r"backward_compute_time=(?P<b>[^,]+), activation_size=(?P<a>.+), "
  r"parameter_size=(?P<p>[^,\s]+)(?: -- stage_id=(?P<stage>\d+))?\s*$"
)
_EDGE = re.compile(r"^\t(?P<src>\S+) -- (?P<dst>\S+)\s*$")
_FIELDS = (
  "forward_compute_time=",
  "backward_compute_time=",
  "activation_size=",
  "parameter_size=",
)
_INPUT = re.compile(r"Input\d*")


@dataclasses.dataclass(frozen=True)
class ProfileGraph:
  """A profiled layer graph: seconds and bytes per node, directed edges.

  Arrays are float64 [num_nodes], in file order; ``edges`` are (src, dst)
  node indices. ``edge_bytes`` (optional, one per edge): the bytes of the
  values each edge carries, where a node has several outputs (a traced
  model's); None: a node's whole ``activation_bytes`` cross any cut it
  has an edge across (a profile's one output per layer).
  """

  names: tuple[str, ...]
  descriptions: tuple[str, ...]
  forward_seconds: np.ndarray
  backward_seconds: np.ndarray
  activation_bytes: np.ndarray
  parameter_bytes: np.ndarray
  edges: tuple[tuple[int, int], ...]
  edge_bytes: tuple[float, ...] | None = None

  @property
  def num_nodes(self) -> int:
    return len(self.names)

  def topological_order(self) -> list[int]:
    """Kahn's order; ties go to the smaller node number (``node12``)."""
    indegree = [0] * self.num_nodes
    succ = [[] for _ in range(self.num_nodes)]
    for u, v in self.edges:
      succ[u].append(v)
      indegree[v] += 1
    key = [_node_number(n) for n in self.names]
    ready = [(key[i], i) for i in range(self.num_nodes) if not indegree[i]]
    heapq.heapify(ready)
    order = []
    while ready:
      _, i = heapq.heappop(ready)
      order.append(i)
      for j in succ[i]:
        indegree[j] -= 1
        if not indegree[j]:
          heapq.heappush(ready, (key[j], j))
    if len(order) != self.num_nodes:
      raise ValueError("the profile graph has a cycle")
    return order

  def is_input(self, node: int) -> bool:
    """PipeDream's data-loading source nodes (``Input``, ``Input0``...)."""
    return _INPUT.fullmatch(self.descriptions[node]) is not None

  def ordered(self):
    """(order, compute seconds, edges as {(pos_u, pos_v): bytes}) in a
    topological order; an edge carries its source's activation bytes.

    Input nodes cost nothing here: their time is data loading, which
    PipeDream's optimizer also zeroes (they stay in the first stage).
    """
    order = self.topological_order()
    position = {node: k for k, node in enumerate(order)}
    compute = np.array(
      [
        0.0
        if self.is_input(i)
        else self.forward_seconds[i] + self.backward_seconds[i]
        for i in order
      ]
    )
    edges = {}
    for u, v in self.edges:
      edges[(position[u], position[v])] = float(self.activation_bytes[u])
    return order, compute, edges


# PipeDream's profiles of 14 models, shipped with jpipe (see README there).
_PROFILE_DIR = os.path.join(os.path.dirname(__file__), "profiles", "pipedream")
PIPEDREAM_PROFILES = tuple(
  sorted(
    d
    for d in os.listdir(_PROFILE_DIR)
    if os.path.isfile(os.path.join(_PROFILE_DIR, d, "graph.txt"))
  )
)


def profile_path(path_or_name: str) -> str:
  """A path as given, or the shipped profile of that name (``vgg16``)."""
  if not os.path.exists(path_or_name) and path_or_name in PIPEDREAM_PROFILES:
    return os.path.join(_PROFILE_DIR, path_or_name)
  return path_or_name


def load_pipedream_profile(path: str) -> ProfileGraph:
  """Parses a PipeDream ``graph.txt`` (see the module docstring): a path
  to it or its folder, or a shipped profile's name (``"vgg16"``)."""
  path = profile_path(path)
  if os.path.isdir(path):
    path = os.path.join(path, "graph.txt")
  if not os.path.isfile(path):
    raise ValueError(
      f"no PipeDream profile at {path!r} (a graph.txt, its folder, or one "
      f"of the shipped {', '.join(PIPEDREAM_PROFILES)})"
    )
  with open(path) as f:
    text = f.read()
  return _parse_text(text) or _parse_lines(path, text)


def _parse_text(text: str) -> ProfileGraph | None:
  """A well-formed file's graph, split on its separators a column at a
  time; None where a line is not exactly what ``_NODE`` or ``_EDGE`` reads
  the same way (another " -- ", a stage_id, a missing field, trailing
  space, a bad number, an unknown node...): the line by line parse then
  reads it, or names the bad line."""
  body = text.rstrip("\n")
  k = body.find("\n\t")
  if k >= 0 and body.count("\n", k) == body.count("\n\t", k):
    # PipeDream's layout: node lines, then edge lines only.
    rows = [x.split(" -- ") for x in body[:k].split("\n")]
    edge_text = body[k + 2 :]
  else:
    lines = text.split("\n")
    rows = [x.split(" -- ") for x in lines if x and x[0] != "\t"]
    edge_text = "\n".join(x for x in lines if x[:1] == "\t")[1:]
  try:
    names, descs, fields = zip(*rows, strict=True)
    columns = list(zip(*[x.split(", ") for x in fields], strict=True))
  except ValueError:  # a line with other separators
    return None
  if len(columns) != len(_FIELDS):
    return None
  f, b, a, p = map(_values, columns, _FIELDS)
  edges = _edge_names(edge_text)
  # Names are \S+; a number with a comma or space fails float() below.
  if None in (f, b, a, p, edges) or not _names(names):
    return None
  index = {n: i for i, n in enumerate(names)}
  try:
    ends = list(map(index.__getitem__, edges))
    pairs = tuple(zip(ends[::2], ends[1::2], strict=True))
    if "[" in a:  # outputs listed: summed
      a = "\n".join(str(_bytes(x)) if "[" in x else x for x in a.split("\n"))
    numbers = np.array(list(map(float, f"{f}\n{b}\n{a}\n{p}".split("\n"))))
  except (KeyError, ValueError):  # an unknown node, a bad number
    return None
  if len(index) != len(names):  # a name twice
    return None
  f, b, a, p = numbers.reshape(4, len(names))
  return ProfileGraph(
    names=names,
    descriptions=descs,
    forward_seconds=f / 1e3,
    backward_seconds=b / 1e3,
    activation_bytes=a.copy(),
    parameter_bytes=p.copy(),
    edges=pairs,
  )


def _values(column, prefix: str) -> str | None:
  """The items of ``column`` less ``prefix``, joined by newlines; None
  unless each starts with it and holds it once."""
  joined = "\n".join(column)
  values = joined.replace(prefix, "")
  if (
    not joined.startswith(prefix)
    or joined.count("\n" + prefix) != len(column) - 1  # each starts with it
    or len(values) != len(joined) - len(column) * len(prefix)  # once
  ):
    return None
  return values


def _edge_names(text: str) -> list[str] | None:
  """Source and destination names of edge lines ("src -- dst", joined by
  a newline and a tab), alternating; None unless each line has one
  separator (a name that is not a node's fails the lookup)."""
  if not text:
    return []
  lines = text.split("\n\t")
  if set(map(str.count, lines, itertools.repeat(" -- "))) != {1}:
    return None
  return text.replace("\n\t", " -- ").split(" -- ")


def _names(names) -> bool:
  """Whether each name is ``\\S+``: not empty, no white space."""
  return all(names) and len(" ".join(names).split()) == len(names)


def _parse_lines(path: str, text: str) -> ProfileGraph:
  """The graph, line by line: a bad line raises naming it."""
  names, descs, f, b, a, p, raw_edges = [], [], [], [], [], [], []
  for number, line in enumerate(text.split("\n"), start=1):
    if not line.strip():
      continue
    edge = _EDGE.match(line)
    if edge:
      raw_edges.append((edge["src"], edge["dst"], number))
      continue
    node = _NODE.match(line)
    if not node:
      raise ValueError(
        f"{path}:{number}: not a node or edge line: {line.strip()[:80]!r}"
      )
    names.append(node["name"])
    descs.append(node["desc"])
    f.append(float(node["f"]) / 1e3)
    b.append(float(node["b"]) / 1e3)
    a.append(_bytes(node["a"]))
    p.append(float(node["p"]))
  index = {n: i for i, n in enumerate(names)}
  if len(index) != len(names):
    raise ValueError(f"{path}: duplicate node names")
  edges = []
  for src, dst, number in raw_edges:
    if src not in index or dst not in index:
      raise ValueError(f"{path}:{number}: edge to an unknown node")
    edges.append((index[src], index[dst]))
  return ProfileGraph(
    names=tuple(names),
    descriptions=tuple(descs),
    forward_seconds=np.array(f),
    backward_seconds=np.array(b),
    activation_bytes=np.array(a),
    parameter_bytes=np.array(p),
    edges=tuple(edges),
  )


def _bytes(text: str) -> float:
  text = text.strip()
  if text.startswith("["):
    return float(sum(float(x) for x in text.strip("[]").split(";")))
  return float(text)


def _node_number(name: str) -> tuple[int, str]:
  digits = re.sub(r"\D", "", name)
  return (int(digits) if digits else -1, name)
