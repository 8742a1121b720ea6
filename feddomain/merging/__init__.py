"""Model merging for hierarchical aggregation (HFedATM): permutation specs and filter-wise OT
alignment, shrinkage-aware RegMean, and Gram capture with optional DP noise."""
