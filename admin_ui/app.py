"""Admin UI entry point: `streamlit run admin_ui/app.py`. The home page lists models, versions and routes."""
import streamlit as st

from admin_ui.data import models_frame

st.set_page_config(page_title="LLM fleet", layout="wide")
st.title("LLM fleet")
st.subheader("Models, versions and routes")
try:
    frame = models_frame()
except Exception as exc:  # the registry may be down: say so, keep the page up
    st.error(f"The registry cannot be read: {exc}")
else:
    if frame.empty:
        st.info("No model versions are registered yet. Run `make up` or `build-engines`.")
    else:
        st.dataframe(frame, hide_index=True, use_container_width=True)
