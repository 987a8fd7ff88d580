"""Tasks with counterfactual prompts, the circuit graph, edge scores, circuits and faithfulness (issue 17)."""
