"""Reading benchmark JSON lines: per-configuration ratios, bounds, memory, grid summaries,
the targets, and the performance model's accuracy.

A record is one (label, run, config, dispatcher) line written by tools/bench_moe_layer.py,
with the expert implementation it ran (``expert_impl``; SequentialMLP in records without one):
a configuration timed with several is one row per implementation, tables gain an ``experts``
column where the rows differ in it, and a label's summary compares each implementation's
times with SequentialMLP's.
Labels name what was run: a link preset of the emulated cluster (``pcie``, ``nvlink``: the
emulator's presets give the link rates), ``unshaped`` (the same grid, links not shaped: the
layer's time without network cost), ``memory`` (a --memory pass: peak memory, no times), or
anything else (e.g. ``ws1``, world size 1). Records of the same label and configuration from
several runs (``run`` tags, repeated passes) are pooled: the median is over every step, and
the spread between the runs' medians is the run-to-run spread. Pure Python (matplotlib only
for the plot), so reports can be made anywhere.

The bound of a configuration and dispatcher is the least time its step can take on the
emulated cluster: max(inter-node bytes of the busiest node's NIC / inter-node rate,
intra-node bytes of the busiest node's loopback / intra-node rate, compute), with the bytes
from the accounting and compute the fastest dispatcher's time of the same configuration
with unshaped links (everything but the shaped links' cost). Efficiency = bound / measured.

The modules, by concern: ``records`` (reading the records, dispatcher names), ``bound`` (the
bound, efficiency, time shares), ``grouping`` (one row per configuration), ``summary`` (the grid's summaries and the goals),
``tables`` (Markdown tables and the plot), ``model`` (the performance model against the
measurements). Their public names are re-exported here.
"""

from megatron_parm.bench.report.records import (  # noqa: F401
    UNSHAPED, MEMORY, REFERENCE, SEQUENTIAL, RECORD_DEFAULTS, BASELINE, TARGETS, SHARE_OF,
    AT_LEAST, base_name, choice_variant, is_auto, chunks_of, parm_schedules, is_parm,
    ordered_dispatchers, is_metadata, load_records, Bound, ConfigResult)
from megatron_parm.bench.report.bound import (  # noqa: F401
    link_rates, compute_ms, shape_key, unshaped_runs, attach_bounds, efficiency, time_shares,
    comm_share)
from megatron_parm.bench.report.grouping import group_results  # noqa: F401
from megatron_parm.bench.report.summary import (  # noqa: F401
    several_expert_impls, expert_impl_times, summarize, check_targets)
from megatron_parm.bench.report.tables import (  # noqa: F401
    markdown_table, memory_table, plot_series, plot_speedups)
from megatron_parm.bench.report.model import (  # noqa: F401
    model_accuracy, model_time_shares)
