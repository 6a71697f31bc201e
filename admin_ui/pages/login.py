"""Login: an admin (operator) or viewer token, checked against the router and kept in the session."""
import streamlit as st

from admin_ui import session

st.title("LLM fleet admin")
if session.role() in session.ROLES:
    st.success(f"Signed in as **{session.role()}**.")
    if st.button("Sign out", key="login_sign_out"):
        session.logout()
        st.rerun()
    st.stop()

column = st.columns([2, 3])[0]
column.write("Sign in with a token. Operators (the `admin-token` in the data dir) may change rollouts, "
             "warm buffers and replica states; viewers (the `viewer-token`: finance, managers) only read.")
with column.form("login"):
    token = st.text_input("Admin or viewer token", type="password", key="login_token")
    submitted = st.form_submit_button("Sign in")
if submitted:
    role, note = session.login(token)
    if role is None:
        column.error(note)
    else:
        if note:
            st.session_state["flash"] = note
        st.session_state["just_signed_in"] = True
        st.rerun()
