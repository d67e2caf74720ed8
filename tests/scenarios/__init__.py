"""Scenario proof for compare/diagnose (issue 13): dumps built from real tiny models by numpy
manipulation, with the expected diagnosis derived from the construction alone.

``build``      records every stream of a few tiny HF families (and SmolLM2-135M when installed)
``faults``     turns recorded streams into a (reference, candidate, expectation) triple
``containers`` writes a side in one of the containers users really produce
``expect``     checks a compare report against an expectation (and names the miss)
"""
