"""What the user asks for: marker arguments (``spec``), session settings (``settings``) and the ini
file read without pytest (``inifile``). Imported in every session: keep it light."""
