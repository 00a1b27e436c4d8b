"""The demo's seeded random DeepSeek-V4 and its drafters, built on the user's machine (the
trained pass-key model ships with the repository instead: ``models/needle_v4``)."""
