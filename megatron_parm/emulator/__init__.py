"""An emulated multi-node cluster on one Linux machine: network namespaces joined by shaped links.

cluster  ClusterSpec, EmulatedCluster, run_command (used by tools/emulate_cluster.py). No torch:
         it launches the ranks of any command, one namespace per node.
"""
