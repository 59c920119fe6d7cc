"""The one list of each set of names a user types: precisions, drafters, acceptance rules.

The CLI's choices, the loader, the pipeline, the drafter registry and the config checks all read
these tuples; nothing spells them again.
"""

from __future__ import annotations

from typing import Literal

#: Model precisions (``--dtype`` / ``--draft-dtype``): fp32 is the exact reference; int8 / int4
#: quantise the projections' weights (int4 = a GGUF's Q4_K blocks exactly) and run on the CPU kernels;
#: int4-all also requantises the other decoder projections to Q4_K (for drafts).
PRECISIONS = ("fp32", "bf16", "int8", "int4", "int4-all")
Precision = Literal["fp32", "bf16", "int8", "int4", "int4-all"]
#: Precisions whose projections are quantised (W8A8 integer kernels).
QUANTIZED = ("int8", "int4", "int4-all")

#: Where draft tokens come from (``--drafter``): the draft model, prompt lookup, a suffix lookup
#: else the model, the draft model's token trees, trees of earlier continuations of the current
#: suffix (no model), trees of its continuations in a datastore of the user's files (no model),
#: Medusa heads or an EAGLE head on the target's hidden states (no draft model), or none (plain
#: decoding).
DRAFTERS = ("model", "ngram", "composite", "tree", "suffix", "retrieval", "medusa", "eagle", "none")
#: The commands' default drafter: the suffix lookup where earlier occurrences agree, else the draft
#: model (at par with or ahead of the model alone on every prompt set measured, greedy and sampled:
#: benchmarks/results/composite_suffix_zen5.md).
DEFAULT_DRAFTER = "composite"
#: The drafters that propose trees (medusa and eagle: when given a --tree).
TREE_DRAFTERS = ("tree", "suffix", "retrieval")
#: The drafters that need a draft model.
MODEL_DRAFTERS = ("model", "composite", "tree")
#: How a tree drafter's children are produced (``--tree-children``): top-k, i.i.d. draws, draws
#: without replacement (each verified by the rule made for it).
TREE_CHILDREN = ("fixed", "sampled", "distinct")

#: Acceptance rules (``--rule``): rejection sampling (lossless; tree drafts get the tree rule
#: made for how their children were produced), block verification of chains (lossless), the tree
#: rules by name (specinfer: i.i.d. children, sequoia: children without replacement, point-mass:
#: deterministic children; a draft of other children is an error), greedy matching (exact at
#: temperature 0), Medusa's typical acceptance (lossy, needs an explicit opt-in).
RULES = ("rejection", "block", "specinfer", "sequoia", "point-mass", "greedy", "typical")
#: The rules that keep the target's law at every temperature (what generate / serve / bench take).
LOSSLESS_RULES = ("rejection", "block", "specinfer", "sequoia", "point-mass")
#: The drafters that read a trained file (``--heads``), and the command that writes it.
TRAINED_DRAFTERS = {"medusa": "verispec train medusa", "eagle": "verispec train eagle"}
