"""Beyond one engine: data-parallel replicas and Ray Data inference, on Ray (the `ray` extra)."""
