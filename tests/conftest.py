"""Shared test configuration.

Hypothesis profiles: ``default`` keeps the suite fast; ``HYPOTHESIS_PROFILE=thorough`` runs
many more examples (for a nightly job or before a release).
"""

import os

from hypothesis import HealthCheck, settings

settings.register_profile("default", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
