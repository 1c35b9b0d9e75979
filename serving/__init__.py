"""Ray Serve applications (trained policies and scorers as HTTP endpoints) — planned, see the issues."""
