"""Admin UI entry point: `streamlit run admin_ui/app.py` (started by `fleet up` on FLEET_ADMIN_UI_PORT).

A multipage app (the page is the URL path, its filters the query string): the Login page until a token is accepted, then Fleet, Models & rollouts, Warm buffers &
autoscaling, Chargeback and Capacity. Each page is one file under admin_ui/pages/ and only lays out what
admin_ui/data.py, usage_data.py and capacity.py return; writes go through the router's admin API.
"""
import streamlit as st

from admin_ui import session

st.set_page_config(page_title="LLM fleet admin", page_icon=":material/dns:", layout="wide")
st.set_option("client.toolbarMode", "viewer")  # no "Deploy" button: this app runs inside the platform

session.restore()
login_page = st.Page("pages/login.py", title="Login", icon=":material/login:", url_path="login")
if session.role() in session.ROLES:
    fleet_page = st.Page("pages/fleet.py", title="Fleet", icon=":material/dns:", url_path="fleet", default=True)
    pages = {
        "Operate": [
            fleet_page,
            st.Page("pages/rollouts.py", title="Models & rollouts", icon=":material/alt_route:", url_path="rollouts"),
            st.Page("pages/buffers.py", title="Warm buffers & autoscaling", icon=":material/speed:",
                    url_path="buffers"),
        ],
        "Plan & bill": [
            st.Page("pages/chargeback.py", title="Chargeback", icon=":material/payments:", url_path="chargeback"),
            st.Page("pages/capacity.py", title="Capacity", icon=":material/monitoring:", url_path="capacity"),
        ],
        "Account": [login_page],
    }
    with st.sidebar:
        st.markdown(f"Signed in as **{session.role()}**")
        if st.button("Sign out", key="sign_out"):
            session.logout()
            st.rerun()
else:
    pages = [login_page]

current = st.navigation(pages)
if st.session_state.pop("just_signed_in", False):
    st.switch_page(fleet_page)
script = session.pending_cookie_script()
if script:
    with st.sidebar:
        st.html(script, unsafe_allow_javascript=True)
current.run()
