"""HugeCTR's Python configuration objects (`hugectr.inference`), as front ends of PSConfig."""
