"""Reduced-precision variants: recipes, quantisation, the gates against fp32, the writing step."""
